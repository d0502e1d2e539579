"""The ``lapheads`` command: one entry point, one sub-command per job.

Every error a user can cause (a bad head spec, a bad option) ends in one line on stderr naming the bad value and
what is allowed, and a non-zero exit status; tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import lapheads

_REPO_ROOT = Path(__file__).resolve().parents[2]


class UserError(Exception):
    """A problem with the user's input or environment; printed as one line, exit status 2."""


def _cmd_demo(args: argparse.Namespace) -> int:
    """Until the vision pipeline lands, the demo is the attention benchmark in its quick form."""
    script = _REPO_ROOT / "benchmarks" / "attention.py"
    if not script.is_file():
        raise UserError(f"benchmark script {script} not found; run the demo from a source checkout (pip install -e .)")
    argv = ["--seq-lens", "256", "1024", "--repeats-scale", str(args.repeats_scale)]
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lapheads",
        description="Laplacian heads for transformers: train, measure and reproduce (arXiv 2602.09297).",
    )
    parser.add_argument("--version", action="version", version=f"lapheads {lapheads.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="the main job on embedded data, with a report at the end")
    demo.add_argument("--repeats-scale", type=float, default=0.5, help="scale the number of timed rounds")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (UserError, lapheads.HeadSpecError) as err:
        print(f"lapheads {args.command}: error: {err}", file=sys.stderr)
        return 2
