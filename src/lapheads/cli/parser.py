"""The ``lapheads`` command line, declared: one sub-parser per command, options with their help, handlers from
``lapheads.cli.commands``; a training task's options come from its config dataclass (``lapheads train TASK --help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import lapheads
from lapheads.cli import commands
from lapheads.config import add_options
from lapheads.evals.options import RUN_ARGUMENTS, LMSource
from lapheads.tasks import EVALUATIONS, TASKS


def _positive_int(value: str) -> int:
    """An integer >= 1, or argparse's one-line error naming the value (``--nproc-per-node 0`` once printed 8)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}; allowed: an integer >= 1")
    return number


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage is one ``--help`` away), as every other lapheads error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class TrainParser(_Parser):
    """A ``train TASK`` parser whose help ends with the task's presets and config fields, built only when asked
    (it imports the training modules); with ``--preset NAME`` before ``--help`` the fields show that preset's
    values."""

    preset_for_help: str | None = None

    def format_help(self) -> str:
        self.epilog = _train_epilog(self.prog.split()[-1], self.preset_for_help)
        return super().format_help()


class _DemoParser(_Parser):
    """``demo --help`` ends with the config fields the demo's runs accept as overrides (fmnist-cpu's values)."""

    def format_help(self) -> str:
        from lapheads.config import config_help

        classify = TASKS["classify"]

        self.epilog = (
            "Both runs are the fmnist-cpu recipe for one epoch (--epochs 2 for the preset's length) and take --key "
            "value overrides of it (shown with its values):\n"
            + config_help(classify.config_type(), classify.preset_table()["fmnist-cpu"])
        )
        return super().format_help()


def _first_sentence(text: str, limit: int = 110) -> str:
    sentence = text.split(". ")[0].split(": ")[0].strip().rstrip(".")
    return sentence if len(sentence) <= limit else sentence[: limit - 3] + "..."


def _train_epilog(task: str, preset: str | None = None) -> str:
    from lapheads.config import config_help

    config_type = TASKS[task].config_type()

    table = TASKS[task].preset_table()
    width = max(map(len, table)) + 2
    presets = "\n".join(f"  {name:{width}s}{_first_sentence(cfg.description)}" for name, cfg in table.items())
    if preset in table:
        fields = f"config fields with preset {preset}'s values (override any with --key value):\n"
        return f"presets:\n{presets}\n\n{fields}{config_help(config_type, table[preset])}"
    return (
        f"presets:\n{presets}\n\nconfig fields (override any with --key value; a preset sets many; "
        f"--preset NAME --help shows its values):\n{config_help(config_type)}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lapheads",
        allow_abbrev=False,  # an override such as --data must never be taken for --data-root
        description="Laplacian heads for transformers: train, measure and reproduce (arXiv 2602.09297).",
        epilog="train and demo also take --key value overrides of any config field (e.g. --lr 5e-4 --epochs 2). "
        "Every command takes --threads auto|N (default auto: the CPUs this process may use, less those other "
        "processes keep busy when it starts; OMP_NUM_THREADS, when set, wins).",
    )
    parser.add_argument("--version", action="version", version=f"lapheads {lapheads.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add_command in (
        _demo_command,
        _train_command,
        _eval_command,
        _generate_command,
        _chat_command,
        _serve_command,
        _export_tb_command,
        _upgrade_command,
        _analyze_command,
        _mix_command,
        _mechanism_command,
        _sweep_command,
        _report_command,
        _across_command,
        _kernel_command,
        _data_command,
    ):
        add_command(sub)
    _document_threads(parser)
    return parser


def _demo_command(sub) -> None:
    """``lapheads demo``."""
    demo = sub.add_parser(
        "demo",
        allow_abbrev=False,
        help="the main job on embedded data, with a report at the end",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.__class__ = _DemoParser  # its help lists the overrides it accepts
    demo.add_argument("--out", default="runs/demo", help="report and run directories go here")
    demo.add_argument("--laplacian-heads", default="3", help="the Laplacian run's spec (the other run has 0)")
    demo.add_argument("--data-root", default=None, help="where Fashion-MNIST is or goes")
    demo.set_defaults(func=commands.cmd_demo, takes_overrides=True)


def _train_command(sub) -> None:
    """``lapheads train``."""
    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model from a preset",
        description="lapheads train TASK --help lists the presets and every config field.",
    )
    tasks = train.add_subparsers(dest="task", metavar="TASK", required=True, parser_class=TrainParser)
    for task in TASKS.values():
        task_parser = tasks.add_parser(
            task.name, allow_abbrev=False, help=task.help, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        task_parser.add_argument(
            "--preset",
            default=None,
            help="a preset name or a .json file of config fields (with --resume: optional, checked against the run)",
        )
        task_parser.add_argument("--laplacian-heads", default=None, help="k, or a per-layer list such as 0,2,2,0")
        task_parser.add_argument(
            "--out", default=None, help="the run directory (default: runs/<task>-<preset>-L<k>-<time>)"
        )
        task_parser.add_argument(
            "--resume",
            action="store_true",
            help="continue the run in --out with its stored "
            "config from its last checkpoint (or from the start if it wrote none)",
        )
        task_parser.set_defaults(func=commands.cmd_train, takes_overrides=True)
        _add_executor_args(task_parser, training=True)
        if task.from_run:
            task_parser.add_argument(
                "--from",
                dest="base_from",
                default=None,
                metavar="RUN_DIR",
                help="the lapheads run to start from (sets --base)",
            )
            task_parser.add_argument(
                "--nanochat",
                dest="nanochat_from",
                default=None,
                metavar="DIR",
                help="a nanochat checkpoint folder to start from instead",
            )


def _eval_command(sub) -> None:
    """``lapheads eval NAME``: one sub-parser per evaluation (the task table's ``EVALUATIONS``), its flags generated
    from the evaluation's options class (``lapheads.evals.options``), so each has only the options it reads."""
    evaluate = sub.add_parser(
        "eval",
        allow_abbrev=False,
        help="evaluate a run directory's final checkpoint",
        description="lapheads eval NAME --help lists an evaluation's options.",
    )
    names = evaluate.add_subparsers(dest="task", metavar="NAME", required=True, parser_class=_Parser)
    for name, help_ in EVALUATION_HELP.items():
        evaluation = EVALUATIONS[name]
        parser = names.add_parser(name, allow_abbrev=False, help=help_)
        parser.add_argument(
            "run_dirs",
            nargs="*",
            metavar="RUN_DIR",
            help="one or more runs, compared" if evaluation.many_runs else "one run",
        )
        own, *more = evaluation.option_classes()
        add_options(parser, own, skip=RUN_ARGUMENTS)
        for other in more:  # the harness's options: those the evaluation's own class does not already have
            taken = {field.name for field in dataclasses.fields(own)}
            group = parser.add_argument_group("--harness (lm-evaluation-harness's options of the same names)")
            add_options(group, other, skip=(*RUN_ARGUMENTS, *taken))
        parser.set_defaults(func=commands.cmd_eval)


#: each evaluation's help line (tests/test_cli.py: one entry per ``EVALUATIONS`` name)
EVALUATION_HELP = {
    "classify": "a classifier's test top-1 (and, with --fit-subset, on training images)",
    "lm": "a language model's bits per byte and benchmarks (or lm-evaluation-harness)",
    "dino": "DINO backbones: k-NN, linear probe, segmentation, PCA pictures",
    "chat": "a chat model's benchmarks, with or without its calculator",
}


def _generate_command(sub) -> None:
    """``lapheads generate``."""
    generate = sub.add_parser("generate", allow_abbrev=False, help="continue a prompt with an LM (streams tokens)")
    generate.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="an LM run directory (or --nanochat DIR)")
    generate.add_argument("--prompt", default="", help="the text to continue (after BOS)")
    generate.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (at most sequence_len)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all)")
    _sampling_options(generate)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--device", default="auto")
    add_options(generate, LMSource, skip=RUN_ARGUMENTS)
    generate.set_defaults(func=commands.cmd_generate)


def _sampling_options(command) -> None:
    """``--top-p``, ``--min-p`` and ``--repetition-penalty``, as the server's requests take them (llama.cpp's CLI
    has all three)."""
    command.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling in (0, 1] (1: all)")
    command.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="in [0, 1] (0: none): only the tokens at least this times as likely as the likeliest (vLLM's order: "
        "before top-k and top-p)",
    )
    command.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 0, 1 = none: a token already in the text has its logit divided by it where positive, multiplied "
        "where not (vLLM's and transformers')",
    )


def _chat_command(sub) -> None:
    """``lapheads chat``."""
    chat = sub.add_parser("chat", allow_abbrev=False, help="talk with a mid/SFT model (streams tokens, calculator)")
    chat.add_argument("run_dir", metavar="RUN_DIR", help="a mid or sft run directory")
    chat.add_argument("--prompt", default=None, help="one question, answered once (for scripts); else interactive")
    chat.add_argument("--system", default="", help="a system prompt (merged into the first user turn)")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most")
    chat.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    chat.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all)")
    _sampling_options(chat)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--no-tools", action="store_true", help="do not run the calculator on tool calls")
    chat.add_argument("--device", default="auto")
    chat.set_defaults(func=commands.cmd_chat)


def _serve_command(sub) -> None:
    """``lapheads serve``."""
    web = sub.add_parser(
        "serve", allow_abbrev=False, help="a web chat and OpenAI's APIs for a run (FastAPI; base runs: completions)"
    )
    web.add_argument("run_dir", metavar="RUN_DIR", help="a run directory: mid or sft (every route), lm (completions)")
    web.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    web.add_argument("--port", type=int, default=8000)
    web.add_argument("--max-tokens", type=int, default=512, help="the longest reply a request may ask for")
    web.add_argument(
        "--max-request-bytes", type=int, default=64_000, help="the largest request body taken (larger: HTTP 413)"
    )
    web.add_argument("--temperature", type=float, default=0.6, help="for requests that do not set it (0 = greedy)")
    web.add_argument("--top-k", type=int, default=50, help="for requests that do not set it (0: all)")
    web.add_argument("--no-tools", action="store_true", help="do not run the calculator on tool calls")
    web.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="chat replies decoded together at most (vLLM's option of that name; 1: one after another)",
    )
    web.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but / and /health (default: $LAPHEADS_API_KEY)",
    )
    web.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (GET /v1/models, each request's 'model'; vLLM's option of that name; "
        "default: the run directory's name)",
    )
    web.add_argument("--device", default="auto")
    web.set_defaults(func=commands.cmd_serve)


def _export_tb_command(sub) -> None:
    """``lapheads export-tb``."""
    export = sub.add_parser(
        "export-tb", allow_abbrev=False, help="replay metrics.jsonl of a run or sweep into TensorBoard event files"
    )
    export.add_argument("path", metavar="RUN_DIR|SWEEP_DIR")
    export.add_argument("--out", default=None, help="default: PATH/tensorboard-export (one folder per run)")
    export.set_defaults(func=commands.cmd_export_tb)


def _upgrade_command(sub) -> None:
    """``lapheads upgrade``."""
    upgrade = sub.add_parser(
        "upgrade",
        allow_abbrev=False,
        help="bring run directories written by an older "
        "lapheads up to the current run-directory contract (config.json only)",
    )
    upgrade.add_argument("paths", nargs="+", metavar="RUN_DIR|SWEEP_DIR")
    upgrade.set_defaults(func=commands.cmd_upgrade)


def _analyze_command(sub) -> None:
    """``lapheads analyze``."""
    analyze = sub.add_parser("analyze", allow_abbrev=False, help="token-geometry metrics of runs, side by side")
    analyze.add_argument("run_dirs", nargs="*", metavar="RUN_DIR")
    analyze.add_argument("--layers", default="all", help='"all" or a comma list such as embed,3,6,norm')
    analyze.add_argument("--max-tokens", type=int, default=1_000_000, help="tokens per layer (a random subset)")
    analyze.add_argument("--fraction", type=float, default=0.99, help="variance fraction for the spectra")
    analyze.add_argument("--top-k", type=int, default=100, help="LM: next-token classes for linguistic collapse")
    analyze.add_argument("--batch-size", type=int, default=256)
    analyze.add_argument("--ema", action="store_true", help="analyse the EMA weights")
    analyze.add_argument("--device", default="auto")
    analyze.add_argument("--out", default=None, help="default: RUN_DIR/report, or <common parent>/analysis")
    analyze.add_argument("--force", action="store_true", help="recompute even if a cached analysis.json matches")
    analyze.add_argument("--data-root", default="data", help="--nanochat: where the held-out Shakespeare text is")
    analyze.add_argument(
        "--over-training",
        action="store_true",
        help="every kept checkpoint of one run, against step (train with --keep-checkpoints 0 to keep them all)",
    )
    add_options(analyze, LMSource, skip=RUN_ARGUMENTS)
    analyze.set_defaults(func=commands.cmd_analyze)


def _mix_command(sub) -> None:
    """``lapheads mix``."""
    mix = sub.add_parser(
        "mix", allow_abbrev=False, help="what each mix head (a V + b PV, learned) became, over the kept checkpoints"
    )
    mix.add_argument("run_dir", metavar="RUN_DIR", help="a run trained with --laplacian-heads mix (or mix heads)")
    mix.add_argument("--out", default=None, help="default: RUN_DIR/report/mix")
    mix.set_defaults(func=commands.cmd_mix)


def _mechanism_command(sub) -> None:
    """``lapheads mechanism``."""
    mechanism = sub.add_parser(
        "mechanism", allow_abbrev=False, help="the heads' mechanism scores of a sweep's finished cells, nothing else"
    )
    mechanism.add_argument("sweep_dir", metavar="SWEEP_DIR", help="a sweep directory (its cells' run directories)")
    mechanism.add_argument("--max-tokens", type=int, default=1_000_000, help="analyze's token budget per cell")
    mechanism.set_defaults(func=commands.cmd_mechanism)


def _sweep_command(sub) -> None:
    """``lapheads sweep``."""
    sweep = sub.add_parser("sweep", allow_abbrev=False, help="a preset over Laplacian specs x seeds, resumable")
    sweep.add_argument("preset", help="a preset name, or a .json preset file (then --task)")
    sweep.add_argument(
        "--laplacian-heads", default=None, help="k values 0,1,3,6 or specs 0;2,2,0,0;sum:3 (default: the plan's arms)"
    )
    sweep.add_argument("--seeds", default=None, help="comma list, e.g. 0,1,2 (default: the plan's)")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    sweep.add_argument("--task", default=None, choices=list(TASKS), help="for preset files")
    sweep.add_argument("--out", default=None, help="the sweep directory (default: runs/sweeps/<preset>)")
    sweep.add_argument("--dry-run", action="store_true", help="print one torchrun command per cell instead")
    sweep.add_argument(
        "--nproc-per-node",
        type=_positive_int,
        default=None,
        help="--dry-run: processes (GPUs) per cell, as torchrun commands (default: 8; a *-cpu preset: one process)",
    )
    sweep.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cells trained at once, each its own process (CPU: 2 "
        "one-thread jobs do ~1.7x the work of one two-thread run)",
    )
    sweep.add_argument(
        "--threads", type=_sweep_threads, default=None, help="--jobs: threads shared by all jobs (default: CPUs)"
    )
    _add_executor_args(sweep, training=False)
    sweep.add_argument(
        "--cpu-kernels",
        default="native",
        choices=["native", "avx2", "avx512"],
        help="cap every CPU kernel library (ATen, MKL, oneDNN) of the cells at this instruction set, so cells "
        "trained on different CPUs agree bit for bit and pair as one environment (default: native)",
    )
    sweep.add_argument(
        "--records",
        default=None,
        metavar="DIR",
        help="write each finished cell's record here (commit it); cells recorded here are skipped",
    )
    sweep.add_argument(
        "--plan", default=None, metavar="PLAN", help="the study's pre-registered plan.json (needs --records)"
    )
    sweep.set_defaults(func=commands.cmd_sweep)


def _report_command(sub) -> None:
    """``lapheads report``."""
    report = sub.add_parser("report", allow_abbrev=False, help="statistics and plots of a sweep")
    report.add_argument(
        "sweep_dir",
        help="a sweep directory, a folder of cell records (sweep --records), or a report's stats.json to restate",
    )
    report.add_argument("--metric", default=None, help="the headline metric (default: the task's)")
    report.add_argument("--no-geometry", action="store_true", help="skip lapheads analyze on the cells")
    report.add_argument(
        "--baseline",
        default="0",
        help="the spec every other is compared with, seed by seed (default 0; another goes to report-vs-SPEC/)",
    )
    report.add_argument(
        "--margin",
        type=float,
        default=None,
        help="the primary metric's equivalence margin: a gain this large ruled out reads 'excluded' (default: the "
        "plan's, for a records folder whose plan fixes one; else the paper's relative error reduction on this "
        "baseline's error rate, where the paper reports one)",
    )
    report.add_argument(
        "--seeds",
        default=None,
        help="report only these seeds, a comma list (a plan's pre-registered stop, e.g. its first 6 pairs: "
        "0,1,2,3,4,5); default: every seed",
    )
    report.set_defaults(func=commands.cmd_report)


def _across_command(sub) -> None:
    """``lapheads across``."""
    across = sub.add_parser(
        "across",
        allow_abbrev=False,
        help="one arm against the baseline across recipes (e.g. learning rates), from the reports' stats.json",
    )
    across.add_argument(
        "recipes",
        nargs="+",
        metavar="LABEL=STATS",
        help="a recipe's label and its report's stats.json, e.g. 1x=docs/reproduction/decomposition/cells/report/"
        "stats.json (two or more)",
    )
    across.add_argument("--reference", required=True, help="the label of the recipe the baseline was tuned at")
    across.add_argument("--arm", required=True, help="the arm tested for a handicap, e.g. 3")
    across.add_argument("--baseline", default="0", help="the arm the recipe was tuned on (default 0)")
    across.add_argument("--metric", default="test top-1 (%)", help="a metric or geometry row of the reports")
    across.add_argument("--alpha", type=float, default=0.05, help="each handicap test's one-sided level")
    across.add_argument("--lower-is-better", action="store_true", help="the metric improves downwards (a loss)")
    across.add_argument("--out", default=None, help="a folder for across.md and across.json (default: print only)")
    across.set_defaults(func=commands.cmd_across)


def _kernel_command(sub) -> None:
    """``lapheads kernel``."""
    kernel = sub.add_parser(
        "kernel", allow_abbrev=False, help="build the op's compiled CPU training node once (~30 s), or say its state"
    )
    kernel.add_argument("action", choices=["build", "status"])
    kernel.add_argument("--force", action="store_true", help="build: rebuild even where it is built")
    kernel.add_argument("--verbose", action="store_true", help="build: show the compiler's output")
    kernel.set_defaults(func=commands.cmd_kernel)


def _data_command(sub) -> None:
    """``lapheads data``."""
    data = sub.add_parser("data", allow_abbrev=False, help="list, fetch or tokenise datasets")
    data.add_argument("action", choices=["list", "fetch", "prepare"])
    data.add_argument("name", nargs="?", default="fashion-mnist")
    data.add_argument("--root", default=None, help="the data root (default: data)")
    data.add_argument("--shards", type=int, default=0, help="fineweb-edu: download the first N shards")
    data.add_argument("--tokenizer", default="char", help="prepare: char, bpe or gpt2")
    data.add_argument("--tokenizer-vocab", type=int, default=4096, help="prepare: BPE vocabulary size")
    data.set_defaults(func=commands.cmd_data)


def _add_executor_args(parser: argparse.ArgumentParser, training: bool) -> None:
    """--executor local|slurm and what a SLURM job asks for (lapheads.study.slurm, through submitit)."""
    what = "the run" if training else "the cells"
    group = parser.add_argument_group("SLURM (through submitit; docs/cluster.md)")
    group.add_argument(
        "--executor",
        default="local",
        choices=["local", "slurm"],
        help=f"where {what} train: here (default) or as SLURM jobs",
    )
    group.add_argument("--slurm-partition", default=None, help="the partition (default: the cluster's default)")
    group.add_argument("--slurm-time", type=int, default=60, metavar="MINUTES", help="a job's time limit (default 60)")
    group.add_argument("--slurm-cpus-per-task", type=int, default=1, help="CPUs (torch threads) per task (default 1)")
    group.add_argument("--slurm-gpus-per-node", type=int, default=0, help="GPUs per node (training: a task per GPU)")
    if training:
        group.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
        group.add_argument(
            "--slurm-tasks-per-node", type=int, default=1, help="tasks per node without GPUs (CPU training, gloo)"
        )
    else:
        group.add_argument(
            "--slurm-array-parallelism", type=int, default=256, help="cells running at once (default 256)"
        )
    group.add_argument(
        "--slurm-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option without its dashes, e.g. account=proj or qos=high (repeatable)",
    )
    group.add_argument("--wait", action="store_true", help="--executor slurm: wait until the job(s) end")


def thread_setting(text: str) -> str:
    """--threads: "auto" or a count this process can run (issue 60: 100,000 was taken, and ran far slower)."""
    from lapheads.hardware import available_cpus

    cpus = available_cpus()
    if text == "auto" or (text.isdigit() and 1 <= int(text) <= cpus):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}; allowed: auto, or 1 to {cpus} (the CPUs this process may use)")


def _sweep_threads(text: str) -> int:
    """sweep's --threads: a count shared by its jobs (never "auto"), at most the CPUs this process may use."""
    if text == "auto":
        raise argparse.ArgumentTypeError("'auto'; allowed: a number of threads shared by the jobs (default: the CPUs)")
    return int(thread_setting(text))


def _document_threads(parser: argparse.ArgumentParser) -> None:
    """Every command's help lists --threads (read before torch starts, by lapheads.hardware; the parser itself
    never sees it) except sweep's, which has its own meaning (threads shared by its jobs)."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, sub in action.choices.items():
            if name != "sweep" and "--threads" not in sub._option_string_actions:
                sub.add_argument(
                    "--threads",
                    default="auto",
                    type=thread_setting,
                    help="auto or N: torch's threads (auto: the CPUs this process may use, less those other processes "
                    "keep busy when it starts; OMP_NUM_THREADS, when set, wins)",
                )
            _document_threads(sub)
