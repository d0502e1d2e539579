"""The ``lapheads`` command: one entry point, one sub-command per job.

Every error a user can cause (a bad head spec, a bad option) ends in one line on stderr naming the bad value and
what is allowed, and a non-zero exit status; tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing
from pathlib import Path

import lapheads
from lapheads.errors import LapheadsError
from lapheads.runs.layout import CONFIG_FILE, SWEEP_FILE
from lapheads.tasks import EVALUATIONS, TASKS


class UserError(LapheadsError):
    """A problem with the user's input or environment; printed as one line, exit status 2."""


def _one_line(err: BaseException) -> str:
    """The user-facing line of an error: lapheads' own message, or an OSError's reason and path."""
    if isinstance(err, OSError) and not isinstance(err, LapheadsError):
        where = f": {err.filename}" if err.filename else ""
        return (
            f"{err.strerror or err}{where} (check that the path exists, is writable and its disk has room; "
            "whatever was written before stays)"
        )
    return " ".join(str(err).split("\n"))


def _cmd_demo(args: argparse.Namespace) -> int:
    from lapheads.study.demo import run_demo

    run_demo(Path(args.out), laplacian_heads=args.laplacian_heads, data_root=args.data_root, overrides=args.overrides)
    return 0


def _default_out(task: str, preset: str, heads: str | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    from lapheads.runs import spec_dir_name

    return Path("runs") / f"{task}-{Path(preset).stem}-{spec_dir_name(heads or 'preset')}-{stamp}"


def _cmd_train(args: argparse.Namespace) -> int:
    from lapheads.tasks.presets import resolve_config, resume_config

    _check_override_names(args.task, args.overrides)
    for option, field in (("base_from", "--base"), ("nanochat_from", "--nanochat")):
        if getattr(args, option, None):  # train mid|sft --from RUN_DIR / --nanochat DIR: config fields
            args.overrides = [*args.overrides, field, getattr(args, option)]
    if args.resume:
        if not args.out:
            raise UserError("--resume needs --out, the run directory to continue")
        out = Path(args.out)
        cfg = resume_config(args.task, out, args.preset, args.laplacian_heads, args.overrides)
    else:
        if args.preset is None:
            raise UserError(
                f"train {args.task} needs --preset (a name or a .json file); see lapheads train {args.task} --help"
            )
        cfg = resolve_config(args.task, args.preset, args.laplacian_heads, args.overrides)
        out = Path(args.out) if args.out else _default_out(args.task, args.preset, args.laplacian_heads)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; allowed: a new directory or a run directory")
    from lapheads.distributed import peer_failures
    from lapheads.tasks import get_task

    train = get_task(args.task).train_function()

    with peer_failures():  # a rank that died under torchrun: one line on the others, not a gloo traceback
        result = train(cfg, out, resume=args.resume, preset=args.preset)
    print(json.dumps({"run_dir": str(out), **result}))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from lapheads.tasks import get_evaluation

    return get_evaluation(args.task)(args)


def _nanochat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nanochat",
        default=None,
        metavar="DIR",
        help="lm: a nanochat checkpoint folder (model_<step>.pt + meta_<step>.json) instead of RUN_DIR",
    )
    parser.add_argument("--step", type=int, default=None, help="--nanochat: the step (default: the last)")
    parser.add_argument(
        "--nanochat-tokenizer",
        default=None,
        metavar="DIR",
        help="--nanochat: the folder of its tokenizer.pkl (default: nanochat's <base>/tokenizer)",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from lapheads.evals.lm import load_lm, stream_text

    if args.max_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError(
            f"--max-tokens {args.max_tokens}, --temperature {args.temperature}, --top-k {args.top_k}: "
            "allowed: numbers >= 0"
        )
    lm = load_lm(
        args.run_dir, nanochat=args.nanochat, step=args.step, tokenizer_dir=args.nanochat_tokenizer, device=args.device
    )
    for piece in stream_text(lm, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed):
        print(piece, end="", flush=True)
    print()
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from lapheads.apps.chat import ChatEngine
    from lapheads.data.conversations import render_for_completion
    from lapheads.runs import CONVERSATIONAL_TASKS, load_gpt_run

    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        raise UserError(
            f"--max-tokens {args.max_tokens}, --temperature {args.temperature}, --top-k {args.top_k}: "
            "allowed: --max-tokens >= 1, the others >= 0"
        )
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty; allowed: a question, e.g. --prompt 'What is 12 + 30?'")
    record, model, tokenizer = load_gpt_run(args.run_dir, args.device)
    if record.get("task") not in CONVERSATIONAL_TASKS:
        raise UserError(
            f"{args.run_dir} is a {record.get('task')!r} run, never trained on conversations; allowed: "
            "a mid or sft run (lapheads train sft --from RUN_DIR)"
        )
    engine = ChatEngine(model, tokenizer, tools=not args.no_tools)
    messages = [{"role": "system", "content": args.system}] if args.system else []

    def answer(text: str, seed: int) -> None:
        messages.append({"role": "user", "content": text})
        prompt = render_for_completion(tokenizer, {"messages": messages})
        pieces = []
        for piece in engine.stream(prompt, args.max_tokens, args.temperature, args.top_k, seed):
            pieces.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})

    if args.prompt is not None:
        answer(args.prompt, args.seed)
        return 0
    print(f"lapheads chat with {args.run_dir} (empty line or Ctrl-D: quit; 'clear': new conversation)")
    for turn in range(10**9):
        try:
            text = input("user> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not text:
            return 0
        if text == "clear":
            del messages[int(bool(args.system)) :]
            continue
        print("assistant> ", end="", flush=True)
        try:
            answer(text, args.seed + turn)
        except LapheadsError as err:  # a conversation grown past the context: say so, keep the session
            print(f"\n(error: {_one_line(err)}; type 'clear' to start over)")
            del messages[-1:]
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from lapheads.apps.serve import ServeLimits, serve

    if not 0 < args.port < 65536 or args.max_tokens < 1 or not 0 <= args.temperature <= 2 or not 0 <= args.top_k <= 200:
        raise UserError(
            f"--port {args.port} --max-tokens {args.max_tokens} --temperature {args.temperature} --top-k "
            f"{args.top_k}: allowed: a port in 1..65535, --max-tokens >= 1, temperature in [0, 2], "
            "top-k in [0, 200]"
        )
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("serve needs FastAPI and uvicorn; allowed: pip install 'lapheads[serve]'") from None
    serve(
        args.run_dir,
        host=args.host,
        port=args.port,
        device=args.device,
        limits=ServeLimits(max_tokens=args.max_tokens),
        tools=not args.no_tools,
        temperature=args.temperature,
        top_k=args.top_k,
    )
    return 0


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from lapheads.tasks import upgrade_run

    for path in args.paths:
        folder = Path(path)
        cells = (
            sorted(p.parent for p in folder.glob("*/" + CONFIG_FILE)) if (folder / SWEEP_FILE).is_file() else [folder]
        )
        for run_dir in cells:
            added = upgrade_run(run_dir)
            print(f"upgrade: {run_dir}: " + (f"added {', '.join(added)}" if added else "already current"))
    return 0


def _cmd_export_tb(args: argparse.Namespace) -> int:
    from lapheads.integrations.tracking import export_tensorboard

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError(
            "export-tb needs the tensorboard package; allowed: pip install 'lapheads[tensorboard]'"
        ) from None
    folders = export_tensorboard(args.path, args.out)
    print(
        f"export-tb: {len(folders)} run(s) written; view with: tensorboard --logdir "
        f"{Path(args.out) if args.out else Path(args.path) / 'tensorboard-export'}"
    )
    return 0


def _cmd_mix(args: argparse.Namespace) -> int:
    from lapheads.study.mix import mix_report

    path = mix_report(args.run_dir, args.out)
    print(path.read_text())
    print(f"report: {path}")
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from lapheads.study.analyze import AnalyzeOptions, analyze_runs

    if args.max_tokens < 2:
        raise UserError(f"--max-tokens {args.max_tokens}: allowed: an integer >= 2")
    options = AnalyzeOptions(
        layers=args.layers,
        max_tokens=args.max_tokens,
        fraction=args.fraction,
        top_k=args.top_k,
        batch_size=args.batch_size,
        ema=args.ema,
        device=args.device,
    )
    if args.over_training:
        from lapheads.study.analyze import analyze_over_training

        if len(args.run_dirs) != 1:
            raise UserError(f"--over-training takes one RUN_DIR; got {len(args.run_dirs)}")
        path = analyze_over_training(args.run_dirs[0], options, args.out)
        print(path.with_suffix(".json").read_text())
        print(f"plot: {path}")
        return 0
    if args.nanochat:
        if args.run_dirs:
            raise UserError("analyze takes RUN_DIRs or --nanochat DIR, not both")
        from lapheads.study.analyze import analyze_nanochat

        _, summary = analyze_nanochat(
            args.nanochat,
            options,
            step=args.step,
            tokenizer_dir=args.nanochat_tokenizer,
            data_root=args.data_root,
            out=args.out,
        )
    else:
        _, summary = analyze_runs(args.run_dirs, args.out, options, force=args.force)
    print(summary.read_text())
    print(f"summary: {summary}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from lapheads.study.sweep import parse_seeds, parse_specs, run_sweep

    specs, seeds = parse_specs(args.laplacian_heads), parse_seeds(args.seeds)
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise UserError(f"--jobs {args.jobs} --threads {args.threads}: allowed: integers >= 1")
    out = args.out or str(Path("runs") / "sweeps" / Path(args.preset).stem)
    record = run_sweep(
        args.preset,
        specs,
        seeds,
        out,
        sets=args.set,
        dry_run=args.dry_run,
        task=args.task,
        nproc=args.nproc_per_node,
        jobs=args.jobs,
        threads=args.threads,
    )
    if not args.dry_run:
        print(f"sweep: {len(record['cells'])} cells done in {out}; next: lapheads report {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from lapheads.study.report import restate, write_report

    if Path(args.sweep_dir).is_file():  # a stats.json: its per-seed values, with today's statistics
        print(restate(args.sweep_dir, margin=args.margin))
        return 0
    path = write_report(
        args.sweep_dir, metric=args.metric, geometry=not args.no_geometry, baseline=args.baseline, margin=args.margin
    )
    print(path.read_text())
    print(f"report: {path}")
    return 0


def _cmd_data(args: argparse.Namespace) -> int:
    from lapheads.data.images import DATASETS, fetch_fashion_mnist, find_fashion_mnist
    from lapheads.data.text import TEXT_DATASETS

    if args.action == "list":
        for name in DATASETS:
            where = find_fashion_mnist(args.root) if name == "fashion-mnist" else None
            print(f"{name:15s} image {'found in ' + str(where) if where else ''}")
        for name in TEXT_DATASETS:
            print(f"{name:15s} text")
        return 0
    if args.action == "prepare":
        if args.name not in TEXT_DATASETS:
            raise UserError(f"data prepare {args.name!r}: allowed: {', '.join(TEXT_DATASETS)}")
        from lapheads.train.lm import LMConfig, prepare_lm_data

        cfg = LMConfig(
            dataset=args.name,
            data_root=args.root or "data",
            tokenizer=args.tokenizer,
            tokenizer_vocab=args.tokenizer_vocab,
            download_shards=args.shards,
        )
        tokenizer, shards = prepare_lm_data(cfg)
        print(json.dumps({"vocab_size": tokenizer.vocab_size, **shards.meta}))
        return 0
    if args.name == "fashion-mnist":
        folder, what = fetch_fashion_mnist(args.root or "data")
        print(f"fashion-mnist: {what}")
    elif args.name == "shakespeare":
        from lapheads.data.text import shakespeare_plays

        plays = shakespeare_plays(args.root or "data")
        print(f"shakespeare: {len(plays)} plays, {sum(len(t) for _, t in plays):,} characters")
    elif args.name == "fineweb-edu":
        from lapheads.data.text import fineweb_shards

        shards = fineweb_shards(Path(args.root or "data") / "fineweb-edu", download=args.shards)
        print(f"fineweb-edu: {len(shards)} shards in {shards[0].parent}")
    else:
        raise UserError(
            f"data fetch {args.name!r}: allowed: fashion-mnist, shakespeare, fineweb-edu (CIFAR downloads with "
            "--download on `train`; ImageNet must be placed as an ImageFolder by hand)"
        )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage is one ``--help`` away), as every other lapheads error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _TrainParser(_Parser):
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
        from lapheads.tasks.presets import CONFIG_TYPES, PRESETS

        self.epilog = (
            "Both runs are the fmnist-cpu recipe for one epoch (--epochs 2 for the preset's length) and take --key "
            "value overrides of it (shown with its values):\n"
            + config_help(CONFIG_TYPES["classify"], PRESETS["classify"]["fmnist-cpu"])
        )
        return super().format_help()


def _first_sentence(text: str, limit: int = 110) -> str:
    sentence = text.split(". ")[0].split(": ")[0].strip().rstrip(".")
    return sentence if len(sentence) <= limit else sentence[: limit - 3] + "..."


def _train_epilog(task: str, preset: str | None = None) -> str:
    from lapheads.config import config_help
    from lapheads.tasks.presets import CONFIG_TYPES, PRESETS

    table = PRESETS[task]
    width = max(map(len, table)) + 2
    presets = "\n".join(f"  {name:{width}s}{_first_sentence(cfg.description)}" for name, cfg in table.items())
    if preset in table:
        fields = f"config fields with preset {preset}'s values (override any with --key value):\n"
        return f"presets:\n{presets}\n\n{fields}{config_help(CONFIG_TYPES[task], table[preset])}"
    return (
        f"presets:\n{presets}\n\nconfig fields (override any with --key value; a preset sets many; "
        f"--preset NAME --help shows its values):\n{config_help(CONFIG_TYPES[task])}"
    )


def _check_override_names(task: str, overrides: list[str]) -> None:
    """An option no config field has is named as unknown (with the nearest one), before anything else is said."""
    import dataclasses
    import difflib

    from lapheads.tasks.presets import CONFIG_TYPES

    fields = {f.name for f in dataclasses.fields(CONFIG_TYPES[task])}
    for item in overrides:
        if item.startswith("--"):
            key = item[2:].split("=", 1)[0].replace("-", "_")
            if key not in fields:
                near = difflib.get_close_matches(key, [*fields, "preset", "out", "resume", "laplacian_heads"], n=1)
                hint = f" (did you mean --{near[0].replace('_', '-')}?)" if near else ""
                raise UserError(
                    f"unknown option --{key.replace('_', '-')}; allowed: a config field{hint}, see lapheads train "
                    f"{task} --help"
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
    demo.set_defaults(func=_cmd_demo, takes_overrides=True)

    train = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model from a preset",
        description="lapheads train TASK --help lists the presets and every config field.",
    )
    tasks = train.add_subparsers(dest="task", metavar="TASK", required=True, parser_class=_TrainParser)
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
        task_parser.set_defaults(func=_cmd_train, takes_overrides=True)
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

    evaluate = sub.add_parser("eval", allow_abbrev=False, help="evaluate a run directory's final checkpoint")
    evaluate.add_argument("task", choices=list(EVALUATIONS))
    evaluate.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="one run (dino: one or more, compared)")
    evaluate.add_argument("--ema", action="store_true", help="classify: evaluate the EMA weights")
    evaluate.add_argument(
        "--fit-subset",
        type=int,
        default=None,
        metavar="N",
        help="classify: also score the first N training images without augmentation (fit_top1, fit_loss)",
    )
    evaluate.add_argument(
        "--tasks",
        default=None,
        help="lm: comma list of val_bpb (default), arc_easy, "
        "arc_challenge, mmlu, gsm8k, humaneval; chat: of arc_easy, arc_challenge, mmlu, gsm8k, "
        "humaneval, arith, letters (default: arith,letters)",
    )
    evaluate.add_argument("--no-tools", action="store_true", help="chat: no calculator (the model's own outputs)")
    evaluate.add_argument(
        "--harness",
        default=None,
        metavar="TASKS",
        help="lm: lm-evaluation-harness tasks (comma "
        "list); with --data-dir the shipped lapheads_{arc_easy,arc_challenge,mmlu,gsm8k,hellaswag} "
        "read <task>.jsonl there",
    )
    evaluate.add_argument(
        "--include-path",
        default=None,
        help="lm --harness: a folder of your own task YAMLs. These are code: lm-eval imports the Python files they "
        "name (!function) and renders their prompts with an unsandboxed Jinja; use only folders you trust",
    )
    evaluate.add_argument("--data-dir", default=None, help="lm: local <task>.jsonl/.parquet files in the hub's schema")
    evaluate.add_argument(
        "--max-examples", type=int, default=None, help="lm: the first N items per task; dino: the first N test images"
    )
    evaluate.add_argument(
        "--max-train", type=int, default=None, help="dino: the first N training images (k-NN, linear)"
    )
    evaluate.add_argument(
        "--ade20k", default=None, help="dino: ADE20K root for the segmentation probe (non-FMNIST runs)"
    )
    evaluate.add_argument("--out", default=None, help="dino: where pca.png goes (default: the first run's report/)")
    evaluate.add_argument("--num-samples", type=int, default=1, help="lm: HumanEval samples per problem (pass@k)")
    evaluate.add_argument("--chat", action="store_true", help="lm: wrap prompts in the chat tokens (SFT models)")
    evaluate.add_argument("--device", default="auto")
    _nanochat_options(evaluate)
    evaluate.set_defaults(func=_cmd_eval)

    generate = sub.add_parser("generate", allow_abbrev=False, help="continue a prompt with an LM (streams tokens)")
    generate.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="an LM run directory (or --nanochat DIR)")
    generate.add_argument("--prompt", default="", help="the text to continue (after BOS)")
    generate.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (at most sequence_len)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--device", default="auto")
    _nanochat_options(generate)
    generate.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", allow_abbrev=False, help="talk with a mid/SFT model (streams tokens, calculator)")
    chat.add_argument("run_dir", metavar="RUN_DIR", help="a mid or sft run directory")
    chat.add_argument("--prompt", default=None, help="one question, answered once (for scripts); else interactive")
    chat.add_argument("--system", default="", help="a system prompt (merged into the first user turn)")
    chat.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most")
    chat.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    chat.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens (0: all)")
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--no-tools", action="store_true", help="do not run the calculator on tool calls")
    chat.add_argument("--device", default="auto")
    chat.set_defaults(func=_cmd_chat)

    web = sub.add_parser("serve", allow_abbrev=False, help="a local web chat with a mid/SFT model (FastAPI)")
    web.add_argument("run_dir", metavar="RUN_DIR", help="a mid or sft run directory")
    web.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    web.add_argument("--port", type=int, default=8000)
    web.add_argument("--max-tokens", type=int, default=512, help="the longest reply a request may ask for")
    web.add_argument("--temperature", type=float, default=0.6, help="for requests that do not set it (0 = greedy)")
    web.add_argument("--top-k", type=int, default=50, help="for requests that do not set it (0: all)")
    web.add_argument("--no-tools", action="store_true", help="do not run the calculator on tool calls")
    web.add_argument("--device", default="auto")
    web.set_defaults(func=_cmd_serve)

    export = sub.add_parser(
        "export-tb", allow_abbrev=False, help="replay metrics.jsonl of a run or sweep into TensorBoard event files"
    )
    export.add_argument("path", metavar="RUN_DIR|SWEEP_DIR")
    export.add_argument("--out", default=None, help="default: PATH/tensorboard-export (one folder per run)")
    export.set_defaults(func=_cmd_export_tb)

    upgrade = sub.add_parser(
        "upgrade",
        allow_abbrev=False,
        help="bring run directories written by an older "
        "lapheads up to the current run-directory contract (config.json only)",
    )
    upgrade.add_argument("paths", nargs="+", metavar="RUN_DIR|SWEEP_DIR")
    upgrade.set_defaults(func=_cmd_upgrade)

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
    _nanochat_options(analyze)
    analyze.set_defaults(func=_cmd_analyze)

    mix = sub.add_parser(
        "mix", allow_abbrev=False, help="what each mix head (a V + b PV, learned) became, over the kept checkpoints"
    )
    mix.add_argument("run_dir", metavar="RUN_DIR", help="a run trained with --laplacian-heads mix (or mix heads)")
    mix.add_argument("--out", default=None, help="default: RUN_DIR/report/mix")
    mix.set_defaults(func=_cmd_mix)

    sweep = sub.add_parser("sweep", allow_abbrev=False, help="a preset over Laplacian specs x seeds, resumable")
    sweep.add_argument("preset", help="a preset name, or a .json preset file (then --task)")
    sweep.add_argument("--laplacian-heads", required=True, help="k values 0,1,3,6 or per-layer specs 0;2,2,0,0")
    sweep.add_argument("--seeds", required=True, help="comma list, e.g. 0,1,2")
    sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    sweep.add_argument("--task", default=None, choices=list(TASKS), help="for preset files")
    sweep.add_argument("--out", default=None, help="the sweep directory (default: runs/sweeps/<preset>)")
    sweep.add_argument("--dry-run", action="store_true", help="print one torchrun command per cell instead")
    sweep.add_argument("--nproc-per-node", type=int, default=8, help="--dry-run: GPUs per cell")
    sweep.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="cells trained at once, each its own process (CPU: 2 "
        "one-thread jobs do ~1.7x the work of one two-thread run)",
    )
    sweep.add_argument("--threads", type=int, default=None, help="--jobs: threads shared by all jobs (default: CPUs)")
    sweep.set_defaults(func=_cmd_sweep)

    report = sub.add_parser("report", allow_abbrev=False, help="statistics and plots of a sweep")
    report.add_argument(
        "sweep_dir", help="a sweep directory, or a report's stats.json to restate with today's statistics"
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
        "paper's relative error reduction on this baseline's error rate, where the paper reports one)",
    )
    report.set_defaults(func=_cmd_report)

    data = sub.add_parser("data", allow_abbrev=False, help="list, fetch or tokenise datasets")
    data.add_argument("action", choices=["list", "fetch", "prepare"])
    data.add_argument("name", nargs="?", default="fashion-mnist")
    data.add_argument("--root", default=None, help="the data root (default: data)")
    data.add_argument("--shards", type=int, default=0, help="fineweb-edu: download the first N shards")
    data.add_argument("--tokenizer", default="char", help="prepare: char, bpe or gpt2")
    data.add_argument("--tokenizer-vocab", type=int, default=4096, help="prepare: BPE vocabulary size")
    data.set_defaults(func=_cmd_data)
    return parser


def _without_threads(argv: list[str]) -> list[str]:
    """The command line less ``--threads auto|N``, which every command takes and lapheads/__init__ applied before
    torch started (lapheads.hardware); ``sweep --threads`` keeps its own meaning (threads shared by its jobs)."""
    if "sweep" in argv[:1]:
        return argv
    kept, skip = [], False
    for i, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item == "--threads" and i + 1 < len(argv):
            value, skip = argv[i + 1], True
        elif item.startswith("--threads="):
            value = item.split("=", 1)[1]
        else:
            kept.append(item)
            continue
        if not (value == "auto" or (value.isdigit() and int(value) > 0)):
            raise SystemExit(f"lapheads: error: --threads {value!r}; allowed: auto or a positive number of threads")
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _without_threads(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["train"] and {"-h", "--help"} & set(argv) and "--preset" in argv[:-1]:
        _TrainParser.preset_for_help = argv[argv.index("--preset") + 1]  # help shows that preset's values
    # Options a sub-command does not declare are config overrides (--key value), typed and checked by the config.
    args, overrides = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if overrides and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    try:
        return args.func(args)
    except (LapheadsError, OSError) as err:  # anything else is a bug and keeps its traceback
        if os.environ.get("LAPHEADS_DEBUG"):
            raise
        print(f"lapheads {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
