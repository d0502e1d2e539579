"""The handlers of the ``lapheads`` sub-commands: each reads its arguments, calls one lapheads function, prints.

Result formatting of an evaluation lives with the evaluation (``lapheads.tasks.EVALUATIONS``); the chat REPL with
the chat engine (``lapheads.apps.chat``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from lapheads.errors import LapheadsError


class UserError(LapheadsError):
    """A problem with the user's input or environment; printed as one line, exit status 2."""


def one_line(err: BaseException) -> str:
    """The user-facing line of an error: lapheads' own message, or an OSError's reason and path."""
    if isinstance(err, OSError) and not isinstance(err, LapheadsError):
        where = f": {err.filename}" if err.filename else ""
        return (
            f"{err.strerror or err}{where} (check that the path exists, is writable and its disk has room; "
            "whatever was written before stays)"
        )
    return " ".join(str(err).split("\n"))


def cmd_demo(args: argparse.Namespace) -> int:
    from lapheads.study.demo import run_demo

    report = run_demo(
        Path(args.out), laplacian_heads=args.laplacian_heads, data_root=args.data_root, overrides=args.overrides
    )
    print(report.read_text())
    print(f"report: {report}")
    return 0


def _default_out(task: str, preset: str, heads: str | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    from lapheads.runs import spec_dir_name

    return Path("runs") / f"{task}-{Path(preset).stem}-{spec_dir_name(heads or 'preset')}-{stamp}"


def _check_override_names(task: str, overrides: list[str]) -> None:
    """An option no config field has is named as unknown (with the nearest one), before anything else is said."""
    import dataclasses
    import difflib

    from lapheads.tasks import TASKS

    fields = {f.name for f in dataclasses.fields(TASKS[task].config_type())}
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


def cmd_train(args: argparse.Namespace) -> int:
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
    options = slurm_options(args)
    if options is not None:
        from lapheads.hardware import kernel_pins_in_force
        from lapheads.study.slurm import submit_training

        job = submit_training(args.task, cfg, out, args.resume, args.preset, options, kernel_pins_in_force())
        print(f"train: submitted SLURM job {job.job_id} ({options.nodes} node(s) x {options.tasks()} task(s)); "
              f"run directory {out}, job logs {out / 'slurm' / job.job_id}")  # fmt: skip
        if not args.wait:
            return 0
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            result = job.results()[0]
        except (FailedJobError, UncompletedJobError) as err:
            from lapheads.study.slurm import SlurmError, log_tail

            raise SlurmError(f"SLURM job {job.job_id} failed: {log_tail(out / 'slurm', job.job_id)}") from err
        print(json.dumps({"run_dir": str(out), **result}))
        return 0

    with peer_failures():  # a rank that died under torchrun: one line on the others, not a gloo traceback
        result = train(cfg, out, resume=args.resume, preset=args.preset)
    print(json.dumps({"run_dir": str(out), **result}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """An evaluation answers its results; the command prints them as one JSON line (what scripts read)."""
    from lapheads.tasks import get_evaluation

    print(json.dumps(get_evaluation(args.task)(args), default=str))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from lapheads.evals.lm import load_lm, stream_text

    if args.max_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise UserError(
            f"--max-tokens {args.max_tokens}, --temperature {args.temperature}, --top-k {args.top_k}: "
            "allowed: numbers >= 0"
        )
    sampling = _sampling_options(args)
    lm = load_lm(
        args.run_dir, nanochat=args.nanochat, step=args.step, tokenizer_dir=args.nanochat_tokenizer, device=args.device
    )
    for piece in stream_text(lm, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed, **sampling):
        print(piece, end="", flush=True)
    print()
    return 0


def _sampling_options(args: argparse.Namespace) -> dict[str, object]:
    """``--top-p``, ``--min-p`` and ``--repetition-penalty`` checked, as ``top_p``, ``min_p`` and ``penalties`` for
    the decoder."""
    from lapheads.apps.penalties import Penalties

    if not 0 < args.top_p <= 1 or not 0 <= args.min_p <= 1 or not args.repetition_penalty > 0:
        raise UserError(
            f"--top-p {args.top_p}, --min-p {args.min_p}, --repetition-penalty {args.repetition_penalty}: allowed: "
            "--top-p in (0, 1], --min-p in [0, 1], --repetition-penalty > 0"
        )
    return {
        "top_p": args.top_p,
        "min_p": args.min_p or None,
        "penalties": Penalties(repetition=args.repetition_penalty),
    }


def cmd_chat(args: argparse.Namespace) -> int:
    from lapheads.apps.chat import ChatEngine, chat_once, chat_repl
    from lapheads.runs import load_gpt_run, trained_on_conversations

    if args.max_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        raise UserError(
            f"--max-tokens {args.max_tokens}, --temperature {args.temperature}, --top-k {args.top_k}: "
            "allowed: --max-tokens >= 1, the others >= 0"
        )
    sampling = _sampling_options(args)
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty; allowed: a question, e.g. --prompt 'What is 12 + 30?'")
    record, model, tokenizer = load_gpt_run(args.run_dir, args.device)
    if not trained_on_conversations(record):
        raise UserError(
            f"{args.run_dir} is a {record.get('task')!r} run, never trained on conversations; allowed: "
            "a mid or sft run (lapheads train sft --from RUN_DIR)"
        )
    engine = ChatEngine(model, tokenizer, tools=not args.no_tools)
    options = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed, **sampling
    )
    if args.prompt is not None:
        chat_once(engine, args.prompt, system=args.system, **options)
        return 0
    chat_repl(engine, name=str(args.run_dir), system=args.system, **options)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from lapheads.apps.serve import serve
    from lapheads.apps.serving import ServeLimits

    if (
        not 0 < args.port < 65536
        or args.max_tokens < 1
        or not 0 <= args.temperature <= 2
        or not 0 <= args.top_k <= 200
        or args.max_num_seqs < 1
    ):
        raise UserError(
            f"--port {args.port} --max-tokens {args.max_tokens} --temperature {args.temperature} --top-k "
            f"{args.top_k} --max-num-seqs {args.max_num_seqs}: allowed: a port in 1..65535, --max-tokens >= 1, "
            "temperature in [0, 2], top-k in [0, 200], --max-num-seqs >= 1"
        )
    name = args.served_model_name
    if name is not None and (not name or any(c.isspace() or not c.isprintable() for c in name) or len(name) > 256):
        raise UserError(
            f"--served-model-name {name!r}: allowed: 1 to 256 printable characters without spaces (a name clients "
            "send as 'model')"
        )
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError(
            "serve needs FastAPI, uvicorn and prometheus-client; allowed: pip install 'lapheads[serve]'"
        ) from None
    if args.threads == "auto" and "OMP_NUM_THREADS" not in os.environ:  # the HTTP side keeps a CPU
        import torch

        from lapheads.apps.serve import model_threads

        torch.set_num_threads(model_threads(torch.get_num_threads()))
    serve(
        args.run_dir,
        host=args.host,
        port=args.port,
        device=args.device,
        limits=ServeLimits(
            max_tokens=args.max_tokens, max_request_bytes=args.max_request_bytes, max_num_seqs=args.max_num_seqs
        ),
        tools=not args.no_tools,
        temperature=args.temperature,
        top_k=args.top_k,
        api_key=args.api_key or os.environ.get("LAPHEADS_API_KEY") or None,  # the environment keeps it out of ps
        name=name,
    )
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    from lapheads.runs.layout import CONFIG_FILE, SWEEP_FILE
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


def cmd_export_tb(args: argparse.Namespace) -> int:
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


def cmd_mix(args: argparse.Namespace) -> int:
    from lapheads.study.mix import mix_report

    path = mix_report(args.run_dir, args.out)
    print(path.read_text())
    print(f"report: {path}")
    return 0


def cmd_mechanism(args: argparse.Namespace) -> int:
    from lapheads.study.report import mechanism_report

    if args.max_tokens < 2:
        raise UserError(f"--max-tokens {args.max_tokens}; allowed: at least 2")
    path = mechanism_report(args.sweep_dir, args.max_tokens)
    print(path.read_text())
    print(f"report: {path}")
    return 0


def cmd_analyze(args: argparse.Namespace) -> int:
    from lapheads.evals.geometry import AnalyzeOptions
    from lapheads.study.analyze import analyze_runs

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


def cmd_sweep(args: argparse.Namespace) -> int:
    from lapheads.study.records import load_plan
    from lapheads.study.sweep import SweepOptions, define_sweep, parse_seeds, parse_specs, run_sweep

    plan = load_plan(args.plan) if args.plan else None
    if (args.laplacian_heads is None or args.seeds is None) and plan is None:
        raise UserError("sweep needs --laplacian-heads and --seeds (or a --plan that declares them)")
    specs = parse_specs(args.laplacian_heads) if args.laplacian_heads is not None else plan.arms
    seeds = parse_seeds(args.seeds) if args.seeds is not None else plan.seeds
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise UserError(f"--jobs {args.jobs} --threads {args.threads}: allowed: integers >= 1")
    out = args.out or str(Path("runs") / "sweeps" / Path(args.preset).stem)
    definition = define_sweep(args.preset, args.task, specs, seeds, args.set, plan)
    options = SweepOptions(
        out=Path(out),
        records=None if args.records is None else Path(args.records),
        plan=plan,
        jobs=args.jobs,
        threads=args.threads,
        cpu_kernels=args.cpu_kernels,
        slurm=slurm_options(args),
        wait=args.wait,
        dry_run=args.dry_run,
        nproc=args.nproc_per_node,
    )
    record = run_sweep(definition, options)
    finished = sum(c.get("status") in ("done", "recorded") for c in record["cells"].values())
    if not args.dry_run and finished == len(record["cells"]):
        print(f"sweep: {len(record['cells'])} cells done in {out}; next: lapheads report {out}")
    elif not args.dry_run:
        print(f"sweep: {finished} of {len(record['cells'])} cells done in {out}; the others are with SLURM")
    return 0


def slurm_options(args: argparse.Namespace):
    """The SLURM job's request from --executor slurm and the --slurm-* options (None: --executor local)."""
    if args.executor != "slurm":
        given = [a for a in ("slurm_partition", "slurm_option") if getattr(args, a, None)]
        # a request only a SLURM job can honour is refused, never dropped (issue 60: --nodes 4 trained on one)
        given += [
            a for a, default in (("nodes", 1), ("slurm_tasks_per_node", 1)) if getattr(args, a, default) != default
        ]
        given += [
            a
            for a, default in (("slurm_gpus_per_node", 0), ("slurm_cpus_per_task", 1))
            if getattr(args, a, default) != default
        ]
        if given or args.wait:
            flags = [f"--{a.replace('_', '-')}" for a in given] + (["--wait"] if args.wait else [])
            raise UserError(f"{' '.join(flags)} without --executor slurm; allowed: add --executor slurm")
        return None
    from lapheads.study.slurm import SlurmOptions

    for option in args.slurm_option:  # lapheads' own job settings are not for --slurm-option to replace
        key = option.partition("=")[0].strip().lstrip("-").replace("_", "-")
        if key in ("signal", "requeue", "nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "time"):
            raise UserError(
                f"--slurm-option {option!r} would replace a setting lapheads makes itself ({key}: the pre-emption "
                "signal and requeue it relies on, or a --slurm-*/--nodes option's); allowed: the --slurm-* options, "
                "or any other sbatch option"
            )
    return SlurmOptions(
        partition=args.slurm_partition,
        time_minutes=args.slurm_time,
        cpus_per_task=args.slurm_cpus_per_task,
        gpus_per_node=args.slurm_gpus_per_node,
        tasks_per_node=getattr(args, "slurm_tasks_per_node", 1),
        nodes=getattr(args, "nodes", 1),
        array_parallelism=getattr(args, "slurm_array_parallelism", 256),
        sbatch=tuple(args.slurm_option),
    )


def cmd_report(args: argparse.Namespace) -> int:
    from lapheads.study.report import restate, write_report
    from lapheads.study.sweep import parse_seeds

    if args.margin is not None and not (math.isfinite(args.margin) and args.margin > 0):
        raise UserError(f"--margin {args.margin}; allowed: a positive number (the gain an equivalence test rules out)")
    if Path(args.sweep_dir).is_file():  # a stats.json: its per-seed values, with today's statistics
        if args.seeds is not None:
            raise UserError(f"--seeds {args.seeds} with {args.sweep_dir}; allowed: a sweep or records folder")
        print(restate(args.sweep_dir, margin=args.margin))
        return 0
    seeds = None if args.seeds is None else parse_seeds(args.seeds)
    path = write_report(
        args.sweep_dir,
        metric=args.metric,
        geometry=not args.no_geometry,
        baseline=args.baseline,
        margin=args.margin,
        seeds=seeds,
    )
    print(path.read_text())
    print(f"report: {path}")
    return 0


def cmd_across(args: argparse.Namespace) -> int:
    from lapheads.study.across import load_recipe, read_across, render, write_across

    pairs = [item.partition("=") for item in args.recipes]
    for item, (label, eq, path) in zip(args.recipes, pairs, strict=True):
        if not (eq and label and path):
            raise UserError(f"recipe {item!r}; allowed: LABEL=STATS, e.g. 1x=RECORDS/report/stats.json")
    recipes = [load_recipe(label, path, args.metric) for label, _, path in pairs]
    reading = read_across(
        recipes, args.reference, args.arm, args.baseline, args.alpha, not args.lower_is_better, args.metric
    )
    if args.out is None:
        print(render(reading), end="")
        return 0
    path = write_across(reading, args.out)
    print(path.read_text(), end="")
    print(f"across: {path}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from lapheads.data.catalog import DATASETS
    from lapheads.data.images import fetch_fashion_mnist, find_fashion_mnist
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
        from lapheads.data.text import TextSource

        source = TextSource(
            args.name,
            args.tokenizer,
            data_root=args.root or "data",
            tokenizer_vocab=args.tokenizer_vocab,
            download_shards=args.shards,
        )
        tokenizer, shards = source.prepare()
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


def cmd_kernel(args: argparse.Namespace) -> int:
    from lapheads.core import native

    if args.action == "build" and (args.force or not native.library_path().is_file()):
        print("kernel: building the compiled CPU node (about 30 s)", flush=True)
        native.build(force=args.force, verbose=args.verbose)
    print(f"kernel: {native.status()}")
    return 0
